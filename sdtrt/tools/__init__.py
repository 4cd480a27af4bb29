"""What users run on engines: compile, validate, bench, profile, debug, block parity, the accuracy guard."""
