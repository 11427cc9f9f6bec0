from k3fasttrack.cli.main import main

main()
