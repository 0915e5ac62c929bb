"""Stage 5: fast KDA, the stage 4 forward split into a parallel prepare kernel and a sequential recurrence."""
