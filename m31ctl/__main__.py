from m31ctl._cli import main

main()
