"""DeepSpeed and what it saves: the ZeRO engine (zero.py, the only module that knows ZeRO), the
checkpoint format, resharding between layouts, and the run directory's file names."""
