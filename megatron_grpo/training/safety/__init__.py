"""What keeps a run safe, beside the run itself (training/): nothing saved is lost, replaced or
corrupted, and a run that cannot go on stops with a message that says what to do.

* ``checkpoint_dirs``: what a checkpoint directory is (tracker, manifest, ``iter_N``, the
  manifest check), which checkpoint --load resumes from, and that a verified one is never
  replaced;
* ``save_lock``: one job per --save directory;
* ``launcher_watch``: a rank whose launcher died exits at once and saves nothing (a job counted
  dead must not go on writing into --save);
* ``divergence``: a diverged run stops, GRPO's non-finite steps are skipped, and non-finite
  weights are never checkpointed;
* ``save_errors``: a failed write (a full or read-only disk) explained as such.

These modules import nothing from the rest of training/ (the import-layout test holds it): the
loop and the checkpoint writer call them. ``training/resume_flags.py`` (what a resume does with
changed flags) stays with the run: it reads the run's own flags and config.
"""
