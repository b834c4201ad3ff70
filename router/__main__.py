from pdserve.router.cli import main

main()
