"""Optional bridges to other trainers; each imports its framework, the core package never does."""
