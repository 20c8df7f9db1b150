"""Live recovery: a rank or a node dies, the survivors go on in the same processes.

``unickpt launch`` (:mod:`.launch`; its command line :mod:`.launch_cli`) starts and
watches a node's workers; node 0's launcher hosts the job's control plane
(:mod:`.control`); ``unickpt.run(fn)`` (:mod:`.run`) runs the training function in each
worker and calls it again, in the same process, on the survivors after a failure.
"""
