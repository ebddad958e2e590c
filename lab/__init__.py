"""
The library the scripts lean on (entry points import it; it imports no entry point):

    checkpoint   one --init_from for every script; saving and loading run folders and checkpoints
    run_folder   what keeps a run folder whole while a run writes it, and how a run that cannot go on stops
    recipes      named sets of train.py settings (the embedded base, the study base, the paper's probe)
    cli          what every command line shares: the model flags, flag types, the table printer, process set-up
    precision    which dtype a run computes in and how weights are held for it
    loss         the training loss without the full logits (equal to model.py's plain path)
    evaluation   the one log-likelihood scorer, the four tasks under both protocols, held-out loss
    run_report   the end-of-run benchmarks of the frozen base and the trained model, side by side
    stats        paired statistics for two evaluations of the same items; growth over depth
"""
