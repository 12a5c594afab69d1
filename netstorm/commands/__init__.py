"""One module per ``netstorm`` sub-command; see ``netstorm.cli``."""
