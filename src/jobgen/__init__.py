"""jobgen: one typed job description, rendered and submitted to Slurm, PBS Pro or Torque."""

__version__ = "0.1.0"
