from rollstream.cli.main import main

main()
