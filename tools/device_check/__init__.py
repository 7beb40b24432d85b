"""The offline GPU machine's one command (tools/device_check.sh) and the steps it runs; docs/GPU.md,
"Running the device check", says how to run it and what it checks."""
