"""What keeps the tutorial's six steps running on real clusters, none of it a step itself.

The top-level modules (config, data, model, callbacks, export) follow the tutorial; the entrypoint calls this
package around them:

- workers: where they come from (worker_sources: TF_CONFIG, a Kubernetes Indexed Job or TrainJob, Slurm), how
  they come together and leave (worker_group), and a GPU box that TensorFlow cannot use (gpu_box);
- faults: pre-emption (sigterm), resume and its backup (resume), one run per output folder (run_lock);
- the terminal and outputs: TensorFlow's start-up notices held back and the summary (terminal), results.json and
  the output folders (outputs), every temporary file in one folder removed at every end (scratch);
- every use of TensorFlow's, tf_keras's and tfds's private parts and error texts (tf_private).
"""
