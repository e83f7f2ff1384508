"""CPU tests of config/: options, flags, --config files."""
