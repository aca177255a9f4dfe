"""`memrl view`: a static HTML viewer of trajectories and evaluations (memrl.viewer.build)."""
