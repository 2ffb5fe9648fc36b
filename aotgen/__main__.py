from aotgen.cli import main

main()
