"""qcal's version, in a module of its own so that the report can name it without importing the
package (which imports the report)."""

__version__ = "0.1.0"
