"""The replication experiment: DIFF V1, DIFF V2 and the Transformer trained side by side
(`replicate`), their sizes (`presets`) and the paper-layout report (`report`)."""
