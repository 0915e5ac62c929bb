"""What every stage shares: seeded inputs, the error measure, input checks and TileLang helpers."""
