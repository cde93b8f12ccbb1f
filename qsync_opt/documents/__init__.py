"""The versioned documents (pydantic schemas) and how they are written and read: atomic files, io, output folders."""
