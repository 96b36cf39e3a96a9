"""The only package that imports Ray: actor shells over the engine's plain classes, the driver's handle on
a run's workers, the step's phases as actor calls, GPU placement, weight-sync choice and the local head."""
