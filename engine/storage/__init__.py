"""What a run leaves behind, through fsspec: checkpoints, the Parquet trajectory lake, metric trackers."""
