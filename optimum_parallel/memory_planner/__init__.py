"""Planning on one process: simulate a plan at any tp, report it, plan files, and the memory planner."""
