"""Reports on allocation traces: replays under several policies and devices, with figures and tables."""
