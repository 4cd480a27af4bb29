"""Where models come from: local folders, hub ids, and the offline presets with random weights."""
