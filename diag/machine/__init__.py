"""What the machine is: the accelerator and its dense peak (device.py, gpus.py), GPU utilisation
(gpu_util.py), the kind of every disk (disks.py)."""
