from deployments.cli import main

main()
