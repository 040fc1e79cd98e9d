"""`ringtrain run`: a TrainingJob as local processes (plan → supervisor → jobstate → console;
:mod:`.cli` is the entry point)."""
