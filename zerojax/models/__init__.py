"""Models written as ZeRO units."""
