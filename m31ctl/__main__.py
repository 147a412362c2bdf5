from m31ctl.cli import run

run()
