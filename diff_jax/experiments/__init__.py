"""The replication experiment: DIFF V1, DIFF V2 and the Transformer trained side by side
(`replicate`), their sizes (`presets`), where runs live (`layout`), and the reports:
`lm_report` (language modeling beside the paper's tables, `paper`) and `recall_report`
(associative recall), both built on `stats` (paired differences) and `plots`."""
