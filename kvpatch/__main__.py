from kvpatch.cli import main

main()
