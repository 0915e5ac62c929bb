"""What every stage shares: seeded inputs, the error measure, shape checks and TileLang helpers."""
