"""Pure rules both the planner and the runtime read: sync modes and the QSR rule, learning-rate schedules, DLCP's drop policy, the boundary codecs."""
