"""Stage 8: context parallelism, one sequence split over devices that hand each other the state."""
