from mlxceld.cli import main

main()
