"""What the machine is: accelerator and dense peak (device, gpus), its state while diag measures
(contention: load, steal, GPU use), disks."""
