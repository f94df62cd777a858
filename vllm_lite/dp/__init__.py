"""Data-parallel concerns shared by launchers, engine cores and the client."""
