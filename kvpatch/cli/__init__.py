"""The command line: click commands and terminal output."""
