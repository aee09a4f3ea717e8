"""attnx experiments: each module defines get_config(preset) and run(config, workdir).

Run one with `python launch.py --config=experiments/NAME.py[:PRESET]`; `python launch.py --list`
lists them with their presets.
"""
