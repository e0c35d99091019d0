"""The side-by-side benchmark suite (``python -m benchmarks``; ``stashpoint bench``).

One module per concern:

* :mod:`.common`: constants, logging, files and the page cache, machine facts;
* :mod:`.memory`: the host-memory monitor (the process and its children);
* :mod:`.state`: the seeded training state (a GPT-style model + AdamW; FSDP2 for 2 ranks);
* :mod:`.methods`: the registry of what is measured, and whether each is available;
* :mod:`.savers` (torch.save, DCP, stashpoint) and :mod:`.peers` (torchsnapshot,
  torch-checkpointing, Accelerate): one saver and one loader per method;
* :mod:`.disk`: the raw disk bandwidth (direct I/O and buffered, hot and cold);
* :mod:`.steptime`: the training-loop experiment (step times while checkpointing every K steps);
* :mod:`.worker`: one method on one state in its own process(es); :mod:`.launch` starts them;
* :mod:`.summary`, :mod:`.report`, :mod:`.plots`: figures, targets, markdown tables, PNGs;
* :mod:`.cli`: the command line and the matrix.
"""
