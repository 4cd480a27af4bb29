"""Engine stand-ins: modules with diffusers' call signatures whose forward runs an engine."""
