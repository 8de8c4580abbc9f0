"""The foundation every layer may use: the typed config and its validation, the error vocabulary,
the choice spellings, atomic files, the runtime (device, dtype, precision, batch plan) and the
lines a command or a run prints. Imports nothing else of lmsys."""
