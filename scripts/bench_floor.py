"""The floor every typer CLI pays: typer plus pydantic, one model, a command with two options.
scripts/bench.py measures m31ctl's commands against this whole-process time."""

import typer
from pydantic import BaseModel


class Options(BaseModel):
    name: str
    count: int


app = typer.Typer(add_completion=False)


@app.command()
def main(name: str = "world", count: int = 1) -> None:
    print(Options(name=name, count=count).model_dump_json())


if __name__ == "__main__":
    app()
