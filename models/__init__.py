"""Model builders: each returns one flat ``nn.Sequential`` whose children are the units of
partitioning. Models know nothing of the pipeline engine or of Hydra."""
