"""fizzbuzz.py 15 prints the fifteen expected lines."""

import subprocess
import sys


def expected(n: int) -> list[str]:
    return [
        "FizzBuzz" if i % 15 == 0 else "Fizz" if i % 3 == 0 else "Buzz" if i % 5 == 0 else str(i)
        for i in range(1, n + 1)
    ]


try:
    ran = subprocess.run([sys.executable, "fizzbuzz.py", "15"], capture_output=True, text=True, timeout=20)
except (OSError, subprocess.TimeoutExpired) as error:
    sys.exit(f"fizzbuzz.py did not run: {error}")
sys.exit(0 if ran.stdout.split() == expected(15) else f"wrong output:\n{ran.stdout}{ran.stderr}")
