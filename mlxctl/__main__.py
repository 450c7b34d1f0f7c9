from mlxctl.app import main

main()
