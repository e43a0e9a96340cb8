"""Old import path, kept only so the NeMo-RL selector string in users' YAML keeps working
(``nemo_dcr.adapters.nemo_rl:DcrCheckpointEngine``).  Everything lives in :mod:`nemo_dcr.integrations`."""
