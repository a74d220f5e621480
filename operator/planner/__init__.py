"""Pure planner: desired spec + observed pods and worker states -> typed actions and the next status."""
