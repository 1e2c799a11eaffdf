from kvpatch.cli import main

main(prog_name="kvpatch")
