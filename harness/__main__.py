"""`python -m harness <hydra overrides>`: see conf/config.yaml and the README."""

import hydra

from harness import CONF_DIR
from harness.app import main as run


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base="1.3")
def main(cfg):
    run(cfg)


if __name__ == "__main__":
    main()
