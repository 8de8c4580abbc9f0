"""The plan of a launch before it starts (lmsys-plan, the check before every launch): the step
traced on fake tensors (trace), ZeRO's arithmetic over it (zero), time and what would fit (plan),
the words (report), the check a launch calls (check). The device table is lmsys.core.devices."""
