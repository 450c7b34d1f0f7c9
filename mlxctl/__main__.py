"""mlxctl: the control CLI of mlxceld. It talks only to the local daemon."""
from mlxctl.main import main

main()
