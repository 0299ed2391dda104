"""One-shot quality: the calibration windows, the least-squares compensation of a cut layer's output
projection, and the lane search by measured KL."""
