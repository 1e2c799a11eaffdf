__version__ = "0.0.0.kvpatch-example"
