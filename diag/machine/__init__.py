"""What the machine is: accelerator and dense peak (device, gpus), GPU use (gpu_util), disks."""
